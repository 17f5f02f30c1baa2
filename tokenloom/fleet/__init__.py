"""Past one machine: engine replicas as Ray Serve deployment replicas behind one OpenAI endpoint.

`routing.py` (pure Python) holds the routing policies; everything else here imports Ray, which is an
optional dependency (`pip install tokenloom[ray]`): a single-process `tokenloom serve` never loads it.

Ray Serve's housekeeping is paced by `ray_env.py`, which every module here that imports Ray imports first.
"""
