"""What consumes editor feedback: the feedback-rl role that turns feedback on served completions
into admitted samples (``rl``) with its pure rules (``rules``), the log of what was served
(``served_log``: only what was served trains), and the feedback ids already stored, read back
from the feedback stream (``seen``). What ingests the feedback is ``producers.feedback``."""
