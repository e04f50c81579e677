"""DeepSeek-V4 model definition and checkpoint loading."""
