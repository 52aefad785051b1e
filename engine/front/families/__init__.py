"""The model families the front reads, one file each."""
