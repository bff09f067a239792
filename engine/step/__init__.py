"""One generation step as the device side sees it: its shape bucket (buckets.py) and its plan as
plain data (plan.py). Below the backends, the models and the runner, which read them, and above
nothing but numpy: engine.generate's planner builds plans, the device side runs them."""
