"""Everything that makes a weight version leave the learner: the publisher (``publisher``), its
pure rules (``rules``: kinds, keyframes, chunk placement), the chunk writer (``chunks``), the
shard rules of a learner of several ranks (``shards``), the retention rule (``retention``) and
manifest signing (``signing``). The wire format is ``schemas.deltacodec.wire``; what receives a
version is ``consumers.weights``."""
