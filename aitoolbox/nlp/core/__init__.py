"""Text helpers (:mod:`.core`) and the token vocabulary (:mod:`.vocabulary`)."""
