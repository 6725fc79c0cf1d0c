"""The version of shardio."""

__version__ = "0.2.0.dev0"
