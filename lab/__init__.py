"""What is not the product: fault drills, the model zoo, rehearsals, the detection benchmark, the
demo and the doc generators. It drives the recorder and the engine from outside, as a user would;
neither of them imports it."""
