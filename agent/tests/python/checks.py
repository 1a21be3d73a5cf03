"""What the openai-client test scripts share: `check` prints `ok NAME` or raises with the detail."""


def check(name, cond, detail=""):
    if not cond:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok {name}", flush=True)
