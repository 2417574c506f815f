"""The `json-schema` workload: prompts each paired with a JSON schema, for structured-output serving.

    kvtide bench serve --base-url http://127.0.0.1:8000 --dataset-name json-schema --num-prompts 64 \\
        --max-concurrency 32 --structured-output-ratio 1.0

Every request carries its schema as vLLM's `"structured_outputs": {"json": SCHEMA}`; with
--structured-output-ratio 0 the same prompts go unconstrained, so two runs compare the same work
with and without the constraint.

The schemas are schema-heavy on purpose: several required keys with long names, nested objects,
arrays of objects, enums, bounded integers and booleans, so much of the output is text the grammar
forces (keys, punctuation) and jump-forward has something to skip. Strings are bounded by a
`pattern` such as `^[a-z]{1,8}$` rather than maxLength, and arrays by maxItems, so that even a random
model's outputs stay short and end by themselves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

DEFAULT_OUTPUT_LEN = 256
"""max_tokens of a json-schema request unless --output-len says otherwise: room for the longest
schema's output in byte-level tokens."""


def _word(max_len: int = 8) -> dict:
    return {"type": "string", "pattern": f"^[a-z]{{1,{max_len}}}$"}


def _code(pattern: str) -> dict:
    return {"type": "string", "pattern": pattern}


def _int(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def _enum(*values: str) -> dict:
    return {"type": "string", "enum": list(values)}


_BOOL = {"type": "boolean"}


def _object(**properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def _array(items: dict, max_items: int) -> dict:
    return {"type": "array", "items": items, "minItems": 1, "maxItems": max_items}


@dataclass(frozen=True)
class SchemaTask:
    """One schema with the instruction that asks for it and the subjects a prompt fills it for."""

    name: str
    instruction: str
    schema: dict
    subjects: tuple[str, ...]


TASKS: tuple[SchemaTask, ...] = (
    SchemaTask("user_profile", "Fill in the user profile as JSON", _object(
        username=_word(), age_in_years=_int(0, 120),
        account_status=_enum("active", "suspended", "pending"), is_email_verified=_BOOL,
        home_address=_object(street_number=_int(1, 9999), city_name=_word(), country_code=_enum("us", "de", "fr", "jp"))),
        ("a retired teacher in Lyon", "a student who just signed up", "a suspended spam account")),
    SchemaTask("order_summary", "Summarize the customer order as JSON", _object(
        order_identifier=_int(1, 99999), customer_name=_word(),
        line_items=_array(_object(product_code=_code("^[A-Z]{2}[0-9]{3}$"), quantity=_int(1, 99),
                                  price_in_cents=_int(0, 99999)), 2),
        shipping_method=_enum("standard", "express", "pickup")),
        ("two books and a lamp, sent express", "a single coffee machine for pickup", "two shirts, standard post")),
    SchemaTask("weather_report", "Write today's weather report as JSON", _object(
        location_name=_word(), temperature_celsius=_int(-60, 60),
        sky_condition=_enum("clear", "cloudy", "rain", "snow", "fog"),
        wind_conditions=_object(speed_kmh=_int(0, 300), direction=_enum("n", "ne", "e", "se", "s", "sw", "w", "nw")),
        precipitation_expected=_BOOL),
        ("a stormy afternoon on the coast", "a cold clear morning in the mountains", "a foggy city evening")),
    SchemaTask("book_record", "Catalogue the book as JSON", _object(
        title_slug=_code("^[a-z]{1,8}(-[a-z]{1,8}){0,2}$"),
        author_details=_object(family_name=_word(), given_name=_word()),
        publication_year=_int(1450, 2030), literary_genre=_enum("novel", "poetry", "history", "science"),
        available_in_library=_BOOL, page_count=_int(1, 2000)),
        ("a long Russian novel", "a thin volume of poems", "a popular history of Rome")),
    SchemaTask("calendar_event", "Describe the meeting as a calendar event in JSON", _object(
        event_title=_word(), start_hour=_int(0, 23), duration_minutes=_int(5, 480),
        attendee_list=_array(_object(attendee_name=_word(), response_status=_enum("accepted", "declined",
                                                                                  "tentative")), 2),
        is_recurring_event=_BOOL),
        ("the weekly team planning", "a one-off dentist appointment", "the quarterly board review")),
    SchemaTask("server_health", "Report the server's health check as JSON", _object(
        hostname=_code("^[a-z]{1,8}[0-9]{1,2}$"), cpu_load_percent=_int(0, 100),
        memory_used_megabytes=_int(0, 1048576), disk_status=_enum("ok", "degraded", "failed"),
        running_services=_array(_object(service_name=_word(), is_running=_BOOL), 2)),
        ("a busy database host", "an idle build machine", "a web server with a failing disk")),
    SchemaTask("recipe_card", "Write the recipe card as JSON", _object(
        recipe_name=_word(), number_of_servings=_int(1, 12), difficulty_level=_enum("easy", "medium", "hard"),
        ingredient_list=_array(_object(ingredient_name=_word(), amount_in_grams=_int(1, 5000)), 2),
        is_vegetarian=_BOOL),
        ("a quick tomato soup", "a slow-cooked beef stew", "a lemon cake for eight")),
    SchemaTask("flight_booking", "Record the flight booking as JSON", _object(
        flight_number=_code("^[A-Z]{2}[0-9]{2,4}$"), departure_airport=_code("^[A-Z]{3}$"),
        arrival_airport=_code("^[A-Z]{3}$"), seat_class=_enum("economy", "premium", "business", "first"),
        passenger_details=_object(last_name=_word(), is_frequent_flyer=_BOOL), checked_bags=_int(0, 3)),
        ("a red-eye from Boston to London", "a short hop from Paris to Nice", "a business trip to Tokyo")),
    SchemaTask("product_review", "Turn the product review into JSON", _object(
        product_identifier=_code("^[A-Z]{3}-[0-9]{4}$"), star_rating=_int(1, 5),
        reviewer_details=_object(display_name=_word(), is_verified_buyer=_BOOL), would_recommend=_BOOL,
        review_tags=_array(_enum("quality", "price", "delivery", "support"), 3)),
        ("an angry review of late headphones", "a glowing review of a kettle", "a mixed review of a tent")),
    SchemaTask("bank_transaction", "Log the bank transaction as JSON", _object(
        transaction_identifier=_int(1, 99999999), amount_in_cents=_int(1, 10000000),
        currency_code=_enum("usd", "eur", "gbp", "jpy"),
        counterparty_details=_object(account_holder=_word(), bank_code=_code("^[A-Z]{4}$")),
        transaction_type=_enum("deposit", "withdrawal", "transfer"), is_flagged_for_review=_BOOL),
        ("a monthly rent transfer", "a large cash withdrawal abroad", "a salary deposit")),
    SchemaTask("student_grades", "Enter the student's report card as JSON", _object(
        student_name=_word(), grade_level=_int(1, 12),
        course_results=_array(_object(course_code=_code("^[A-Z]{3}[0-9]{3}$"),
                                      letter_grade=_enum("a", "b", "c", "d", "f"), credit_hours=_int(1, 6)), 2),
        is_on_honor_roll=_BOOL),
        ("a top student in the final year", "a struggling freshman", "a transfer student mid-year")),
    SchemaTask("vehicle_listing", "Create the used-car listing as JSON", _object(
        manufacturer=_enum("toyota", "ford", "honda", "volkswagen", "bmw"), model_name=_word(),
        model_year=_int(1990, 2025), odometer_kilometers=_int(0, 500000),
        feature_summary=_object(has_sunroof=_BOOL, has_navigation=_BOOL, seat_count=_int(2, 9)),
        listing_status=_enum("available", "reserved", "sold")),
        ("a family van with high mileage", "a nearly new hatchback", "a classic convertible, already sold")),
)


def schema_prompt(task: SchemaTask, subject: str) -> str:
    """The prompt names the task and its schema (compact JSON), as an application would."""
    schema_text = json.dumps(task.schema, separators=(",", ":"))
    return (f"{task.instruction}. Answer with one JSON object that follows this schema:\n{schema_text}\n"
            f"Subject: {subject}.\nJSON:")


def json_schema_jobs(num_prompts: int, seed: int, any_whitespace: bool = False) -> list[tuple[str, dict]]:
    """(prompt, structured_outputs) for num_prompts requests: every task in turn, subjects drawn by
    --seed, then shuffled; the same arguments give the same list.

    Without any_whitespace the constraint asks for compact JSON (disable_any_whitespace): under a
    grammar that admits free whitespace between tokens, a random model fills max_tokens with it."""
    rng = np.random.default_rng([seed, 1])
    jobs = []
    for i in range(num_prompts):
        task = TASKS[i % len(TASKS)]
        subject = task.subjects[int(rng.integers(len(task.subjects)))]
        constraint: dict = {"json": task.schema}
        if not any_whitespace:
            constraint["disable_any_whitespace"] = True
        jobs.append((schema_prompt(task, subject), constraint))
    order = rng.permutation(len(jobs))
    return [jobs[i] for i in order]
