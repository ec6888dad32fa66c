"""Frontend (API-process side): tokenizer, detokenization and output assembly."""
