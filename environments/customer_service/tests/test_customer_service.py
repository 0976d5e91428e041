"""customer_service: task databases, the tools on good and bad calls, the database reward, and a
whole support conversation through the chat harness, with the customer played by the user
simulator's MCP server in front of a second scripted model."""

from __future__ import annotations

import copy
import re

import pytest

import customer_service as cs
from flywheel.sdk.environment import messages_of
from flywheel.sdk.harness import RolloutContext
from tests.helpers import num_tasks
from tests.scripted_openai import ScriptedOpenAI, ScriptEntry, make_rollout, run_rollout, tool_call


@pytest.fixture(scope="module")
def tasks() -> dict[str, dict]:
    env = cs.load_environment()
    return {row["id"]: row for row in env.load_tasks(num_tasks(env))}


def context(task: dict) -> RolloutContext:
    return RolloutContext(task=task, base_url="", api_key="", model="", state={"db": copy.deepcopy(task["db"])})


def test_each_task_holds_only_what_it_needs(tasks: dict[str, dict]) -> None:
    env = cs.load_environment()
    assert len(tasks) == 12
    for task in tasks.values():
        env.check_task(task)
        assert list(task["db"]["users"]) == [task["user_id"]]
        assert set(task["db"]["orders"]) == set(task["db"]["users"][task["user_id"]]["orders"])
        changed = cs.expected_database(task) != task["db"]
        assert changed == bool(task["actions"]), task["id"]
    assert [m.role for m in env.prompt_messages(tasks["cancel-one-of-two"])] == ["system", "user"]


def test_reading_tools_and_their_errors(tasks: dict[str, dict]) -> None:
    ctx = context(tasks["new-address-two-orders"])
    assert cs.find_user_id_by_name_zip(ctx, "omar", "Haddad ", "60614") == "omar_haddad_1937"
    assert cs.find_user_id_by_email(ctx, "Omar.Haddad@example.com") == "omar_haddad_1937"
    assert cs.get_order_details(ctx, "W2001")["items"][0]["name"] == "Desk Lamp"
    for call, message in [(lambda: cs.find_user_id_by_email(ctx, "mei.chen@example.com"), "no user with email"),
                          (lambda: cs.find_user_id_by_name_zip(ctx, "Omar", "Haddad", "60610"), "zip code 60610"),
                          (lambda: cs.get_order_details(ctx, "#W1001"), "order '#W1001' not found"),
                          (lambda: cs.get_product_details(ctx, "6992792935"), "product '6992792935' not found"),
                          (lambda: cs.get_user_details(ctx, "mei_chen_4821"), "user 'mei_chen_4821' not found")]:
        with pytest.raises(cs.ToolError, match=message):
            call()


def test_writing_tools_enforce_the_rules(tasks: dict[str, dict]) -> None:
    ctx = context(tasks["exchange-headphones-gift-card"])
    with pytest.raises(cs.ToolError, match="is pending; only delivered orders can be returned"):
        cs.return_delivered_order_items(ctx, "#W1001", ["1001"], "credit_card_7281")
    with pytest.raises(cs.ToolError, match="reason 'changed my mind'"):
        cs.cancel_pending_order(ctx, "#W1001", "changed my mind")
    with pytest.raises(cs.ToolError, match="is not available"):
        cs.exchange_delivered_order_items(ctx, "#W1002", ["3001"], ["3002"], "gift_card_3150")
    with pytest.raises(cs.ToolError, match="not an option of Wireless Headphones"):
        cs.exchange_delivered_order_items(ctx, "#W1002", ["3001"], ["1001"], "gift_card_3150")
    with pytest.raises(cs.ToolError, match="item '3003' is not in order"):
        cs.return_delivered_order_items(ctx, "#W1002", ["3003"], "credit_card_7281")
    with pytest.raises(cs.ToolError, match="payment method 'paypal_1' not found"):
        cs.return_delivered_order_items(ctx, "#W1002", ["3001"], "paypal_1")
    assert ctx.state["db"] == ctx.task["db"]  # failed calls change nothing
    cancelled = cs.cancel_pending_order(ctx, "#W1001", "no longer needed")
    assert cancelled["status"] == "cancelled" and cancelled["payment_history"][-1]["transaction_type"] == "refund"
    with pytest.raises(cs.ToolError, match="is cancelled; only pending orders can be cancelled"):
        cs.cancel_pending_order(ctx, "#W1001", "no longer needed")

    omar = context(tasks["exchange-shirt-unavailable-size"])
    with pytest.raises(cs.ToolError, match="original payment method"):
        cs.return_delivered_order_items(omar, "#W2003", ["1002"], "credit_card_9904")
    swapped = cs.exchange_delivered_order_items(omar, "#W2003", ["1002"], ["1003"], "paypal_5520")
    assert swapped["exchange_price_difference"] == 2.0 and swapped["status"] == "exchange requested"

    sofia = context(tasks["gift-card-balance-and-return"])
    sofia.state["db"]["users"]["sofia_rossi_5093"]["payment_methods"]["gift_card_2290"]["balance"] = 30.0
    with pytest.raises(cs.ToolError, match=re.escape("holds 30.00, less than the price difference 55.50")):
        cs.exchange_delivered_order_items(sofia, "#W5001", ["3003", "4001"], ["3001", "4002"], "gift_card_2290")


def test_a_cancelled_gift_card_order_is_refunded_at_once(tasks: dict[str, dict]) -> None:
    task = copy.deepcopy(tasks["cancel-no-longer-needed"])
    order = task["db"]["orders"]["#W1001"]
    order["payment_history"][0]["payment_method_id"] = "gift_card_3150"
    ctx = context(task)
    cs.cancel_pending_order(ctx, "#W1001", "ordered by mistake")
    assert ctx.state["db"]["users"]["mei_chen_4821"]["payment_methods"]["gift_card_3150"]["balance"] == 99.98


@pytest.mark.parametrize(("output", "text", "found"), [
    ("50", "The difference is $50.00, refunded to your gift card.", True),
    ("50", "That is 50 dollars.", True),
    ("50", "You will get $150 back.", False),
    ("50", "It costs 50.50.", False),
    ("120", "Your balance is $1,120.", False),
    ("120", "Your gift card holds 120.00.", True),
    ("delivered", "The order was Delivered yesterday.", True),
])
def test_outputs_are_found_as_whole_figures(output: str, text: str, found: bool) -> None:
    assert cs.said(output, text) is found


async def test_rewards_from_the_final_database(tasks: dict[str, dict]) -> None:
    env = cs.load_environment()
    task = tasks["cancel-one-of-two"]
    messages = [{"role": "user", "content": task["opening"]}, {"role": "assistant", "content": "Done."}]

    async def rewards(state: dict, task: dict = task, messages: list = messages) -> dict[str, float]:
        rollout = make_rollout("customer_service", task, messages, state)
        return {name: (await r(rollout)).value for name, r in env.rollout_rewards.items() if name != "num_tool_calls"}

    right, wrong = context(task), context(task)
    cs.cancel_pending_order(right, "#W2002", "ordered by mistake")
    cs.cancel_pending_order(wrong, "#W2001", "ordered by mistake")  # the lamp order: the customer kept that one
    assert await rewards(right.state) == {"success": 1.0, "db_match": 1.0, "outputs_said": 1.0, "tool_errors": 0.0}
    assert (await rewards(wrong.state))["success"] == 0.0
    reason = context(task)
    cs.cancel_pending_order(reason, "#W2002", "no longer needed")  # right order, wrong reason
    assert (await rewards(reason.state))["db_match"] == 0.0
    assert (await rewards({}))["success"] == 0.0  # the rollout failed before the database existed
    balance = tasks["gift-card-balance-and-return"]
    done = context(balance)
    cs.return_delivered_order_items(done, "#W5001", ["4001"], "gift_card_2290")
    silent = await rewards(done.state, balance, [{"role": "assistant", "content": "Your return is requested."}])
    assert silent["db_match"] == 1.0 and silent["outputs_said"] == 0.0 and silent["success"] == 0.0


async def test_a_support_conversation_with_a_simulated_customer(tasks: dict[str, dict]) -> None:
    task = tasks["exchange-headphones-gift-card"]
    agent: list[ScriptEntry] = [
        "I can help with that. What is the email address on your account?",
        tool_call("find_user_id_by_email", email="mei.chen@example.com"),
        tool_call("get_order_details", order_id="W1002"),
        tool_call("get_product_details", product_id="6992792935"),
        tool_call("exchange_delivered_order_items", order_id="#W1002", item_ids=["3001"], new_item_ids=["3002"],
                  payment_method_id="gift_card_3150"),
        tool_call("exchange_delivered_order_items", order_id="#W1002", item_ids=["3001"]),
        ("I can exchange your black over-ear headphones (item 3001) for the black in-ear ones (item 3003). "
         "The price difference of $50.00 goes to your gift card gift_card_3150. Shall I go ahead?"),
        tool_call("exchange_delivered_order_items", order_id="#W1002", item_ids=["3001"], new_item_ids=["3003"],
                  payment_method_id="gift_card_3150"),
        "Done: the exchange is requested, and $50.00 will be refunded to your gift card.",
    ]
    user = ["It's mei.chen@example.com.", "Yes, please.", "Great, thanks! ###STOP###"]
    with ScriptedOpenAI({"agent": agent, "user": user}) as server:
        env = cs.load_environment(user_base_url=server.base_url, user_model="user")
        rollout = await run_rollout(env, task, server)
        assert server.remaining("agent") == server.remaining("user") == 0
        brief = server.requests_for("user")[0]["messages"]
    assert brief[0]["role"] == "system" and task["instructions"] in brief[0]["content"]
    assert [m["role"] for m in brief[1:]] == ["assistant", "user"]  # the customer sees the agent as its user
    assert brief[1]["content"] == task["opening"] and brief[2]["content"] == agent[0]
    said = [m["content"] for m in messages_of(rollout) if m["role"] == "tool"]
    assert said[0] == "mei_chen_4821" and "is not available" in said[3] and "invalid arguments" in said[4]
    assert rollout.state["stop_reason"] == "done"
    assert rollout.state["db"]["orders"]["#W1002"]["exchange_price_difference"] == -50.0
    values = {name: (await r(rollout)).value for name, r in env.rollout_rewards.items()}
    assert values == {"success": 1.0, "db_match": 1.0, "outputs_said": 1.0, "num_tool_calls": 6.0, "tool_errors": 2.0}


async def test_transfer_ends_the_conversation_and_a_missing_customer_model_is_named(tasks: dict[str, dict]) -> None:
    task = tasks["cancel-processed-refused"]
    with ScriptedOpenAI({"agent": [tool_call("transfer_to_human_agents", summary="wants to cancel #W4001")],
                         "user": []}) as server:
        env = cs.load_environment(user_base_url=server.base_url, user_model="user")
        rollout = await run_rollout(env, task, server)
    assert rollout.state["stop_reason"] == "stop" and rollout.state["transferred"] == "wants to cancel #W4001"
    assert (await env.rollout_rewards["success"](rollout)).value == 1.0  # nothing was to change
    with pytest.raises(ValueError, match="user_base_url and user_model"):
        await run_rollout(cs.load_environment(), task, server)
