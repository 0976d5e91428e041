"""customer-service: an online store's support agent, in the style of tau-bench.

The model is the agent. A simulated customer (a model behind an MCP server, given the task's
private instructions) opens with the task's first line and answers the agent's questions; the
agent follows the store's policy (the system prompt) and acts with tools on an in-memory
database: find the customer (by email, or by name and zip code), read users, orders and
products, then cancel a pending order, change a pending order's address, change the account's
address, or request the return or exchange of delivered items, or transfer to a human. Each
task's database holds only what it needs: its customer, their orders, and the products in
those orders (sliced from the packaged store at load). Tool errors (an unknown id, an order in
the wrong status, an item that is not available) go back to the agent as messages.

Reward, as in tau-bench: ``success`` is 1 when the database the conversation leaves behind
(``state["db"]``) equals the one the task's reference actions produce from the same start,
and the agent told the customer every figure the task asks for (``outputs``); otherwise 0.
Metrics: ``db_match``, ``outputs_said``, ``num_tool_calls``, ``tool_errors``.

The customer's model is set with ``user_base_url`` and ``user_model`` (any OpenAI-compatible
endpoint); without them rewards and task sets still work, and a rollout fails at its start
with a message saying what to set.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Any

from flywheel.sdk.environment import Environment, EnvironmentLoadError, Metric, Reward, TaskSet
from flywheel.sdk.harness import ChatHarness, RolloutContext, ToolError, UserSimulator, user_simulator_server

POLICY = """You are a customer support agent of an online store. Help the customer with their orders using the
tools, following this policy.

- First authenticate the customer: find their user id by email, or by first name, last name and zip code.
  Do this even if they give you a user id. Help only that one customer, and only with their own orders.
- Look up the details you need with the tools; do not make up information, order ids or item ids.
- Before any action that changes the database (cancel, change an address, return, exchange), tell the
  customer exactly what you will do and get an explicit "yes". Then make the tool call.
- Only pending orders can be cancelled or have their address changed. The cancellation reason is either
  "no longer needed" or "ordered by mistake"; the refund goes to the original payment method.
- Processed orders can be neither cancelled nor changed.
- Only delivered orders can be returned or exchanged. A return is refunded to the original payment
  method or to a gift card of the customer. An exchange swaps each item for an available item of the same
  product with other options; the price difference is paid with, or refunded to, one of the customer's
  payment methods (a gift card must cover a payment). Collect every item to return or exchange first:
  each order allows one return or exchange request.
- Transfer to a human agent only when the request cannot be handled with your tools and this policy.
- Be concise. When a figure matters to the customer (a balance, a price difference), say it."""

USER_BRIEF = """You are a customer writing to the support chat of an online store. The messages you receive are the
agent's. Pursue the goal in your instructions below. Give information only when the agent asks for it,
a piece at a time; never invent details that are not in your instructions. Write short, natural
messages. When the agent proposes exactly what you want, confirm with "yes".

Your instructions: {instructions}"""

CANCEL_REASONS = ("no longer needed", "ordered by mistake")
TASK_SCHEMA = {"id": str, "user_id": str, "opening": str, "instructions": str, "actions": list, "outputs": list,
               "db": dict}


# --- the database -------------------------------------------------------------------------------


def _db(ctx: RolloutContext) -> dict[str, Any]:
    return ctx.state["db"]


def _user(db: dict[str, Any], user_id: str) -> dict[str, Any]:
    if user_id not in db["users"]:
        raise ToolError(f"user {user_id!r} not found")
    return db["users"][user_id]


def _order(db: dict[str, Any], order_id: str) -> dict[str, Any]:
    order_id = order_id.strip()
    order_id = order_id if order_id.startswith("#") else f"#{order_id}"
    if order_id not in db["orders"]:
        raise ToolError(f"order {order_id!r} not found")
    return db["orders"][order_id]


def _payment_method(db: dict[str, Any], order: dict[str, Any], payment_method_id: str) -> dict[str, Any]:
    methods = _user(db, order["user_id"])["payment_methods"]
    if payment_method_id not in methods:
        raise ToolError(f"payment method {payment_method_id!r} not found for this user (they have "
                        f"{', '.join(methods)})")
    return methods[payment_method_id]


def _require_status(order: dict[str, Any], status: str, action: str) -> None:
    if order["status"] != status:
        raise ToolError(f"order {order['order_id']} is {order['status']}; only {status} orders can be {action}")


def _items(order: dict[str, Any], item_ids: list[str]) -> None:
    remaining = [item["item_id"] for item in order["items"]]
    if not item_ids:
        raise ToolError("give at least one item id")
    for item_id in item_ids:
        if item_id not in remaining:
            raise ToolError(f"item {item_id!r} is not in order {order['order_id']} (or is listed more times than "
                            f"the order holds it)")
        remaining.remove(item_id)


# --- tools: reading -----------------------------------------------------------------------------


def find_user_id_by_email(ctx: RolloutContext, email: str) -> str:
    """Find a customer's user id by their email address."""
    for user in _db(ctx)["users"].values():
        if user["email"].lower() == email.strip().lower():
            return user["user_id"]
    raise ToolError(f"no user with email {email!r}")


def find_user_id_by_name_zip(ctx: RolloutContext, first_name: str, last_name: str, zip: str) -> str:
    """Find a customer's user id by their first name, last name and zip code."""
    for user in _db(ctx)["users"].values():
        name = user["name"]
        if (name["first_name"].lower(), name["last_name"].lower(), user["address"]["zip"]) == (
                first_name.strip().lower(), last_name.strip().lower(), zip.strip()):
            return user["user_id"]
    raise ToolError(f"no user named {first_name} {last_name} with zip code {zip}")


def get_user_details(ctx: RolloutContext, user_id: str) -> dict[str, Any]:
    """A customer's details: name, email, address, payment methods (gift card balances) and order ids."""
    return _user(_db(ctx), user_id)


def get_order_details(ctx: RolloutContext, order_id: str) -> dict[str, Any]:
    """An order's status, address, items (item id, product id, options, price) and payments, e.g. '#W1001'."""
    return _order(_db(ctx), order_id)


def get_product_details(ctx: RolloutContext, product_id: str) -> dict[str, Any]:
    """A product's variants: item id, options, price and whether it is available."""
    products = _db(ctx)["products"]
    if product_id not in products:
        raise ToolError(f"product {product_id!r} not found")
    return products[product_id]


# --- tools: writing -----------------------------------------------------------------------------


def cancel_pending_order(ctx: RolloutContext, order_id: str, reason: str) -> dict[str, Any]:
    """Cancel a pending order; reason is 'no longer needed' or 'ordered by mistake'. Payments are refunded
    to their methods (a gift card at once)."""
    db = _db(ctx)
    order = _order(db, order_id)
    _require_status(order, "pending", "cancelled")
    if reason not in CANCEL_REASONS:
        raise ToolError(f"reason {reason!r}: use {' or '.join(repr(r) for r in CANCEL_REASONS)}")
    for payment in [p for p in order["payment_history"] if p["transaction_type"] == "payment"]:
        order["payment_history"].append({**payment, "transaction_type": "refund"})
        method = _payment_method(db, order, payment["payment_method_id"])
        if method["source"] == "gift_card":
            method["balance"] = round(method["balance"] + payment["amount"], 2)
    order["status"] = "cancelled"
    order["cancel_reason"] = reason
    return order


def modify_pending_order_address(ctx: RolloutContext, order_id: str, address1: str, address2: str, city: str,
                                 state: str, country: str, zip: str) -> dict[str, Any]:
    """Change the shipping address of a pending order (address2 may be empty)."""
    order = _order(_db(ctx), order_id)
    _require_status(order, "pending", "changed")
    order["address"] = _address(address1, address2, city, state, country, zip)
    return order


def modify_user_address(ctx: RolloutContext, user_id: str, address1: str, address2: str, city: str, state: str,
                        country: str, zip: str) -> dict[str, Any]:
    """Change a customer's default address (address2 may be empty); their orders keep theirs."""
    user = _user(_db(ctx), user_id)
    user["address"] = _address(address1, address2, city, state, country, zip)
    return user


def _address(address1: str, address2: str, city: str, state: str, country: str, zip: str) -> dict[str, str]:
    fields = {"address1": address1, "address2": address2, "city": city, "state": state, "country": country,
              "zip": zip}
    missing = [k for k, v in fields.items() if k != "address2" and not v.strip()]
    if missing:
        raise ToolError(f"address fields {missing} are empty")
    return {k: v.strip() for k, v in fields.items()}


def return_delivered_order_items(ctx: RolloutContext, order_id: str, item_ids: list[str],
                                 payment_method_id: str) -> dict[str, Any]:
    """Request the return of items of a delivered order; the refund goes to payment_method_id (the original
    payment method or a gift card of the customer) once the items arrive."""
    db = _db(ctx)
    order = _order(db, order_id)
    _require_status(order, "delivered", "returned")
    _items(order, item_ids)
    method = _payment_method(db, order, payment_method_id)
    original = {p["payment_method_id"] for p in order["payment_history"]}
    if payment_method_id not in original and method["source"] != "gift_card":
        raise ToolError(f"a refund goes to the original payment method ({', '.join(sorted(original))}) or a gift "
                        f"card, not {payment_method_id}")
    order["status"] = "return requested"
    order["return_items"] = sorted(item_ids)
    order["return_payment_method_id"] = payment_method_id
    return order


def exchange_delivered_order_items(ctx: RolloutContext, order_id: str, item_ids: list[str], new_item_ids: list[str],
                                   payment_method_id: str) -> dict[str, Any]:
    """Request the exchange of items of a delivered order for other options of the same products (new_item_ids,
    in the same order as item_ids); the price difference is paid with or refunded to payment_method_id."""
    db = _db(ctx)
    order = _order(db, order_id)
    _require_status(order, "delivered", "exchanged")
    _items(order, item_ids)
    if len(new_item_ids) != len(item_ids):
        raise ToolError(f"{len(item_ids)} item(s) to exchange but {len(new_item_ids)} new item(s): give one new "
                        f"item per item")
    difference = 0.0
    for old_id, new_id in zip(item_ids, new_item_ids, strict=True):
        item = next(i for i in order["items"] if i["item_id"] == old_id)
        variants = db["products"][item["product_id"]]["variants"]
        if new_id not in variants:
            raise ToolError(f"item {new_id!r} is not an option of {item['name']} (product {item['product_id']})")
        if new_id == old_id:
            raise ToolError(f"item {new_id!r} is the item itself; pick other options")
        if not variants[new_id]["available"]:
            raise ToolError(f"item {new_id!r} ({item['name']}, {variants[new_id]['options']}) is not available")
        difference += variants[new_id]["price"] - item["price"]
    difference = round(difference, 2)
    method = _payment_method(db, order, payment_method_id)
    if method["source"] == "gift_card" and difference > method["balance"]:
        raise ToolError(f"gift card {payment_method_id} holds {method['balance']:.2f}, less than the price "
                        f"difference {difference:.2f}")
    order["status"] = "exchange requested"
    order["exchange_items"] = sorted(item_ids)
    order["exchange_new_items"] = sorted(new_item_ids)
    order["exchange_payment_method_id"] = payment_method_id
    order["exchange_price_difference"] = difference
    return order


def transfer_to_human_agents(ctx: RolloutContext, summary: str) -> str:
    """Transfer the customer to a human agent, with a summary of their issue; this ends the conversation."""
    ctx.state["transferred"] = summary
    return "Transfer successful."


TOOLS: list[Callable[..., Any]] = [
    find_user_id_by_email, find_user_id_by_name_zip, get_user_details, get_order_details, get_product_details,
    cancel_pending_order, modify_pending_order_address, modify_user_address, return_delivered_order_items,
    exchange_delivered_order_items, transfer_to_human_agents]
TOOLS_BY_NAME = {fn.__name__: fn for fn in TOOLS}


# --- tasks and the database each one needs ------------------------------------------------------


def task_database(store: dict[str, Any], user_id: str) -> dict[str, Any]:
    """The slice of the store a task needs: its user, their orders and the products in them."""
    user = store["users"][user_id]
    orders = {o: store["orders"][o] for o in user["orders"]}
    product_ids = sorted({item["product_id"] for o in orders.values() for item in o["items"]})
    return copy.deepcopy({"users": {user_id: user}, "orders": orders,
                          "products": {p: store["products"][p] for p in product_ids}})


def expected_database(task: dict[str, Any]) -> dict[str, Any]:
    """The task's database after its reference actions."""
    ctx = RolloutContext(task=task, base_url="", api_key="", model="", state={"db": copy.deepcopy(task["db"])})
    for action in task["actions"]:
        TOOLS_BY_NAME[action["name"]](ctx, **action["arguments"])
    return ctx.state["db"]


def load_tasks(tasks_file: Path, store_file: Path) -> list[dict[str, Any]]:
    store = json.loads(store_file.read_text())
    rows = TaskSet.from_jsonl(tasks_file, schema={k: v for k, v in TASK_SCHEMA.items() if k != "db"})
    out = []
    for row in rows.rows(rows.size or 0):
        where = f"customer_service: task {row['id']!r} in {tasks_file}"
        if row["user_id"] not in store["users"]:
            raise EnvironmentLoadError(f"{where}: user {row['user_id']!r} is not in {store_file}")
        row["db"] = task_database(store, row["user_id"])
        try:
            expected_database(row)
        except (ToolError, KeyError, TypeError) as exc:
            raise EnvironmentLoadError(f"{where}: its reference actions do not apply ({exc})") from exc
        out.append(row)
    return out


# --- rewards --------------------------------------------------------------------------------------


def said(output: str, text: str) -> bool:
    """Whether ``text`` states ``output``: a number (50 matches $50.00, not 150 or 50.5) or words."""
    text = text.replace(",", "").lower()
    if re.fullmatch(r"\d+(\.\d+)?", output):
        return re.search(rf"(?<![\d.]){re.escape(output)}(?:\.0+)?(?!\.?\d)", text) is not None
    return re.search(rf"\b{re.escape(output.lower())}\b", text) is not None


def db_match(state: dict, task: dict) -> float:
    return float("db" in state and state["db"] == expected_database(task))


def outputs_said(messages: list[dict], task: dict) -> float:
    if not task["outputs"]:
        return 1.0
    agent = "\n".join(m["content"] for m in messages if m["role"] == "assistant")
    return sum(said(str(o), agent) for o in task["outputs"]) / len(task["outputs"])


def success(state: dict, messages: list[dict], task: dict) -> float:
    return float(db_match(state, task) == 1.0 and outputs_said(messages, task) == 1.0)


def num_tool_calls(messages: list[dict]) -> float:
    return float(sum(len(m.get("tool_calls", [])) for m in messages))


def tool_errors(messages: list[dict]) -> float:
    return float(sum(m["role"] == "tool" and m["content"].startswith("error:") for m in messages))


# --- the environment ------------------------------------------------------------------------------


def load_environment(user_base_url: str | None = None, user_model: str | None = None, user_api_key: str = "none",
                     user_temperature: float = 0.0, max_turns: int = 30, tasks_file: str | None = None,
                     store_file: str | None = None) -> Environment:
    """``user_base_url``/``user_model``/``user_api_key``: the OpenAI-compatible model that plays the
    customer; ``max_turns``: agent model calls; ``tasks_file``/``store_file``: other tasks and store."""
    here = Path(str(files(__name__)))
    rows = load_tasks(Path(tasks_file) if tasks_file else here / "tasks.jsonl",
                      Path(store_file) if store_file else here / "store.json")

    def setup(task: dict, state: dict) -> None:
        if user_base_url is None or user_model is None:
            raise ValueError("customer_service needs a model to play the customer: load it with user_base_url "
                             "and user_model (any OpenAI-compatible endpoint)")
        state["db"] = copy.deepcopy(task["db"])

    user = None
    if user_base_url is not None and user_model is not None:
        server = user_simulator_server(user_base_url, user_model, lambda task: USER_BRIEF.format(**task),
                                       api_key=user_api_key, temperature=user_temperature)
        user = UserSimulator(server)
    return Environment(
        name="customer_service",
        tasks=TaskSet.from_rows(rows, schema=TASK_SCHEMA, name="customer_service tasks"),
        harness=ChatHarness(system_prompt=POLICY, tools=TOOLS, user=user, setup=setup, max_turns=max_turns,
                            stop=lambda state: "transferred" in state),
        prompt=lambda task: task["opening"],
        rewards=[Reward(success), Metric(db_match), Metric(outputs_said), Metric(num_tool_calls), Metric(tool_errors)],
        sampling={"temperature": 1.0, "max_tokens": 1024},
        version="0.1.0",
        description=__doc__.split("\n\n")[0],
    )
