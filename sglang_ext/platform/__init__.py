"""Host platforms the engine runs on (only the CPU needs help)."""
