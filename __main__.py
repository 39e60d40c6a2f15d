"""``python -m rlstream`` is the same as the ``rlstream`` command."""

from rlstream.ops.cli import main

raise SystemExit(main())
