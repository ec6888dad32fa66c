"""The engine core: requests, KV block pool, scheduler, model runner and the step loop."""
