"""What watches a run: reading its streams without a group (``run_reader``), folding them by pure
rules (``analytics``), the live dashboard (``dashboard``, its page in ``static/``), the static
report (``report``) and the ledger of what was released, decided and trained (``ledger``)."""
