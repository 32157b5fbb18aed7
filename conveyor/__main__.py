"""`python -m conveyor ...` is the same as the `conveyor` console script."""

from conveyor.cli import main

if __name__ == "__main__":
    main()
