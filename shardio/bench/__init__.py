"""``shardio bench``: emulated training runs of shardio and its peers, and their report.

Modules: ``settings`` (what a run does, the runner protocol, a peer to compare with),
``loop`` (the timed loop, cold caches), ``runners`` (shardio's runner, the run of every
runner), ``peers`` (loose files and webdataset, which import torch), ``report`` (figures,
checks and the text or JSON report) and ``plot`` (the optional matplotlib figure). Nothing
is imported with the package.
"""
