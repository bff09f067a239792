"""Speech to text: the speech engine (engine.py), its async driver (driver.py), Whisper's decoding
rules (decoding.py, pure Python) and word timestamps (alignment.py)."""
