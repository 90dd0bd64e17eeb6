"""`python -m bulkinfer.api.cli …`: the `bulkinfer` command without its console script."""

from bulkinfer.api.cli import main

raise SystemExit(main())
