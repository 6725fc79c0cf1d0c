"""The version of shardio."""

__version__ = "0.1.0"
