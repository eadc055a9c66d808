"""Pure helpers shared by the layers above (trainer, workers, engines): no Ray, no models, no hybridflow imports
beyond this package and device.py. seeds.py: deterministic seeds; metrics.py: reducing metric dicts, a device's
matmul peak; faults.py: fault specs."""
