"""Everything that receives a weight version: the one reader of weight manifests
(``manifest_log``), the subscriber that fetches, verifies, stages and swaps versions
(``subscriber``) with its pure route rules (``routes``), and the version watcher of the roles
that only need the current version number (``versions``). The wire format is
``schemas.deltacodec.wire``; what publishes a version is ``producers.weights``."""
