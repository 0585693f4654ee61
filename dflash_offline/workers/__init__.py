"""Worker processes of generate, regenerate and train: starting, watching, failing and stopping them.

Modules:
  records.WorkerSpec, WorkerFailed   what a worker is given; its failure, carried to its coordinator
  group.WorkerGroup, watch           a coordinator's view of its workers, whatever started them
  spawned.SpawnedWorkers             processes spawned by the coordinator (one per GPU or CPU worker)
  ranks.RankWorkers                  the ranks of a ``torchrun``, seen from rank 0 (events over its store)
  lifeline.die_with_parent           a worker dies with its coordinator
  device.bind_device                 a worker binds its device (or its CPU threads) in its own process
"""
