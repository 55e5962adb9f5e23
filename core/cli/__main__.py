"""`python -m core.cli`: the same as the `spool` command."""

from core.cli.main import main

if __name__ == "__main__":
    main()
