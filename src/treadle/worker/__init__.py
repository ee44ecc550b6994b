"""The engine worker: one process (or one torchrun group, treadle.worker.group) per served model.

`treadle serve` starts and watches one per model; `treadle worker` runs one on its own, on
another device or machine, connected to the API's hub address.
"""
