"""The dataset tools as library functions: verify, repair, unpack (the CLI calls them).

Modules: ``verify`` (check every shard and the index against the manifest), ``repair``
(rebuild damaged shards from a source, resumable), ``unpack`` (write a dataset back out as a
tree of files). Nothing is imported with the package.
"""
