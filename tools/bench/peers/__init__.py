"""Other libraries measured on the same files and sizes as our I/O benchmark, when they are installed."""
