"""rlstream's Kafka clients: the settings every client is made from (``settings``: one frozen
model turned into librdkafka keys), the event producer, sole owner of transactions
(``producer``), and topic administration (``admin``)."""
