"""``python -m autoshard.cli``: the same as the ``autoshard`` command."""

from autoshard.cli.main import main

raise SystemExit(main())
