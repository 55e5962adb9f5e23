"""A metric that needs nothing from a hub (lm-eval's exact_match loads `evaluate` from one)."""


def process_results(doc, results):
    return {"contains": float(doc["answer"].lower() in results[0].lower())}
