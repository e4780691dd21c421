"""Multi-LoRA: adapters read from PEFT folders and checked against the base (`weights`), the
projections wrapped to add each row's low-rank update in one batched step (`layers`), and the device
slots adapters are paged into and out of, least recently used first (`pool`)."""
