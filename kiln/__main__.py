"""`python -m kiln ...` is the `kiln` command."""

from kiln.cli import kiln_main

raise SystemExit(kiln_main())
