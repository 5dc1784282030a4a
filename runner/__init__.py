"""ckrun's runner: recipes, building, the memory plan, measuring memory, the training loop and predicting memory."""

import logging


def _not_for_users(record: logging.LogRecord) -> bool:
    # torchao registers its enums with torch's pytree at import, which torch >= 2.13 answers with a deprecation
    # warning per enum on stderr; transformers imports torchao whenever it is installed (its quantizers), so
    # every command printed two lines about torchao's internals that no user can act on
    return "is an Enum subclass and is now natively supported" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_not_for_users)
