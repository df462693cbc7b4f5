"""``python -m serving {generate,bench,train-tiny} --help``."""

from serving.cli import main

if __name__ == "__main__":
    main()
