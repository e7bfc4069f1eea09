"""The serving watch: is the deployed draft still as good live as it was evaluated? (`dspark watch`)

Scrape (scrape.py) -> pool and judge the counter deltas (drift.py) against the champion's
evaluation (evaluated.py) -> one MLflow point per tick (serving_run.py); tick.py runs one tick.
Submitting the retrain a tick fires is the launcher's (hpc/launch/retrain.py).
"""
