"""What starts and runs a run: each role's declaration and start (``roles``), the run's typed
configuration (``config``) and regions (``regions``), where a command finds Kafka
(``kafka_env``), supervision (``supervise``), a learner's ranks (``ranks``), the least-privilege
ACLs of every role (``acls``), the demo's whole run (``demo``), replay and run management
(``replay``), and the faults a chaos run injects (``faults``). The recipes are in
``ops/recipes/``."""
