"""Optional trainer-framework adapters for ODBClient (`pip install 'odbd[hf]'`).

    from odbclient.adapters.hf import ODBTrainer               # Hugging Face Trainer
    from odbclient.adapters.accelerate import ODBAccelerate    # an Accelerate loop

Nothing is imported here, so `import odbclient` never pays for transformers or accelerate.
"""
