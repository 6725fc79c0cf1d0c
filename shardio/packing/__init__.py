"""Packing: scan a tree, plan shards, write them in worker processes, merge parts (torch-free)."""
