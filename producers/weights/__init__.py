"""Everything that makes a weight version leave the learner: the publisher (``publisher``),
the shard rules of a learner of several ranks (``shards``), the retention rule (``retention``)
and manifest signing (``signing``). The wire format is ``schemas.deltacodec.wire``; what
receives a version is ``consumers.weights``."""
