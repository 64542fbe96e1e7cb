"""Rules, rule mappers and the autograd pieces behind :class:`tdhook.attribution.LRP`."""
