"""A share group's intake (``kafka.group_type: share``, KIP-932), the alternative to the consumer
group's source of :mod:`streamproc.intake` (stage 1): the share source thread (:mod:`.source`)
and its ledger of the poll in flight (:mod:`.ledger`). It feeds the same lanes, rings and
batcher (it imports :mod:`streamproc.intake`; nothing there imports it).
"""
