"""Engine backends behind one interface (base.py): the in-process local engine, and a client of
SGLang's native HTTP API; factory.py opens the one the settings ask for (a pool for HTTP engines)."""
