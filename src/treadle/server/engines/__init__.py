"""The API side's engine handles: one per served model (WorkerEngine, several under a
ReplicatedEngine), the hub the workers connect to, and the supervisor that starts them."""
