"""angel-ptm: pretraining runtime for models larger than GPU memory."""

__version__ = "0.1.0"
