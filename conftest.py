"""Import the package before pytest collects any of its files, so that each module exists once.

With ``--import-mode=importlib``, pytest imports a source file it collects for its doctests under the file's module
name. Where the package was not imported yet (a doctest run alone: ``pytest src/tdhook/attribution/rules/base.py``),
that file's code runs twice, once for pytest and once for the package's own imports, and the doctest's functions
then hold other module state than the ones the package calls (``plain_calls`` set a flag that the rules never
read). Imported here first, every file pytest collects is already in ``sys.modules``, and pytest takes it from there.
"""

import tdhook.attribution  # noqa: F401
