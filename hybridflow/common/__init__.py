"""Pure helpers shared by the layers above (trainer, workers, engines): no Ray, no models, no hybridflow imports
beyond this package. seeds.py: deterministic seeds; metrics.py: reducing metric dicts; faults.py: fault specs."""
