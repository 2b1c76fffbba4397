"""``python -m angel_ptm train ...``: the same command line as the ``angel-ptm`` script."""

from angel_ptm.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
