"""Every report on local disk first, then to the collector: the spool and its sender.

The write-ahead spool (:mod:`.disk_spool`, its metadata files in :mod:`.spool_files`, what a full
disk refuses held in :mod:`.spool_memory`, its lock and the fork guard in :mod:`.forks`), the
background sender (:mod:`.shipper`), the agent's only HTTP code (:mod:`.transport`) and
``qkwatch sync`` (:mod:`.sync`).
"""
