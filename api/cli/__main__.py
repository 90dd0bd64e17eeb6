"""`python -m api.cli …`: the `bulkinfer` command without its console script."""

from api.cli import main

raise SystemExit(main())
