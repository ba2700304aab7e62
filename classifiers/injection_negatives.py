"""The hard negatives of the ``injection`` head (labeled ``prompt``): questions about routers and
tiers, and developers' prompts, written and generated, that use an injection's words in their
technical sense (force, skip, override, premium, escalate, bigger, fallback ...). Choices come from
SHA-256 of a seed and the row number (:func:`pick`), never a random generator, as the positives'
in :mod:`classifiers.injections`."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from classifiers.datasets import Rows

CLEAN = "prompt"


def pick(options: Sequence[str], seed: str, part: str) -> str:
    digest = hashlib.sha256(f"{seed}:{part}".encode()).digest()
    return options[int.from_bytes(digest[:4], "big") % len(options)]


_ABOUT = (
    "how BGP routes packets between autonomous systems",
    "how a load balancer decides which server gets a request",
    "how React Router matches nested routes",
    "how LLM routers decide between a small and a large model",
    "the difference between GPT-4o and Llama 3 70B on coding tasks",
    "which GPU to buy for fine-tuning a 7B model",
    "how much VRAM a 70B model needs at 4-bit",
    "how model distillation makes a small model imitate a big one",
    "what quantization does to a model's accuracy",
    "how chain-of-thought prompting improves math answers",
    "how to calibrate a classifier's probabilities",
    "what prompt injection is and how to defend against it",
    "why 'ignore previous instructions' attacks work on chatbots",
    "how to write a good system prompt",
    "a customer-support escalation policy with three tiers",
    "pricing tiers for a SaaS product with a free, pro and enterprise plan",
    "an email telling customers the premium plan price goes up",
    "how priority queues work in Python",
    "how a CPU scheduler decides which process runs next",
    "how DNS resolvers forward queries",
    "how a mail server routes email",
    "how a GPU differs from a CPU",
    "the biggest animal that ever lived",
    "the most powerful computer in 1990",
    "the largest lake in Africa",
    "the best model of electric car for a family",
    "which smartphone model has the best camera",
    "how a router and a modem differ",
    "the cheapest way to travel across Europe",
    "how to upgrade Python on Ubuntu",
    "how to switch from npm to pnpm",
    "how to forward a port on a router",
    "how to redirect stdout to a file in bash",
    "how a classifier decides between categories",
    "what the confidence interval of a poll means",
)
_ASK = (
    "Explain {}.",
    "What is {}?",
    "Can you explain {}?",
    "Write a short guide to {}.",
    "Summarize {}.",
    "Give me an overview of {}.",
    "I'm curious about {}. Can you explain?",
    "Describe {} in simple terms.",
    "Tell me about {}.",
    "Write a paragraph on {}.",
    "For a blog post, explain {}.",
    "Quick question: {}?",
)


# Developers' prompts: errors, logs, configs and operations questions whose words (force, skip,
# override, priority, premium, upgrade, escalate, fallback, tier, model, route, bigger, debug)
# are meant in their technical sense. The shared data has almost no such prompts, so without these
# the head reads technical text as nearer its generated positives than its negatives.
_TECH = (
    "git push --force-with-lease was rejected: stale info. What does that mean?",
    "! [rejected] main -> main (non-fast-forward)\nerror: failed to push some refs",
    "How do I skip a flaky test in pytest only on CI?",
    "npm ERR! ERESOLVE unable to resolve dependency tree. Should I use --force or --legacy-peer-deps?",
    "How do I override values.yaml for one environment in Helm without copying the whole file?",
    "kubectl get pods shows CrashLoopBackOff and the previous container logs are empty",
    "What does priorityClassName do in a Kubernetes pod spec, and when does preemption kick in?",
    "nginx returns 502 Bad Gateway after I moved the upstream to port 8081",
    "upstream backend { server 10.0.0.5:8080 max_fails=3; server 10.0.0.6:8080 backup; } "
    "why does the backup server never get traffic?",
    "Should I upgrade from Postgres 13 to 16 with pg_upgrade or dump and restore?",
    'ERROR: could not obtain lock on relation "orders"\nHow do I find which session holds it?',
    "Premium SSD v2 or Ultra Disk for a 2 TB database with 20k IOPS?",
    "Our PagerDuty escalation policy pages the manager before the secondary on-call. How do I reorder the tiers?",
    "Route 53 weighted routing: 90/10 between two load balancers, but all traffic goes to one. Why?",
    "Express router: app.use('/api', router) and router.get('/users') returns 404",
    'Traceback (most recent call last):\n  File "train.py", line 88, in <module>\n    model.fit(X, y)\n'
    "ValueError: Input contains NaN",
    "RuntimeError: CUDA error: device-side assert triggered. How do I get a useful stack trace?",
    "torch.cuda.OutOfMemoryError at batch size 16 on an A100 40GB. Gradient checkpointing or a smaller batch?",
    "How much faster is bf16 than fp32 inference for a 7B model on an L4?",
    "Which is cheaper per million tokens for a chatbot: a self-hosted 8B model on one GPU or a hosted API?",
    "Our OpenAI API calls fail with 429 rate_limit_exceeded during the nightly batch. How should we back off?",
    "How do I add a fallback model in my LangChain chain when the primary times out?",
    "What is the difference between max_tokens and max_completion_tokens in the chat completions API?",
    "Django: should this be a ForeignKey or a ManyToManyField on the Order model?",
    "In Rails, how do I skip a before_action callback for one controller action?",
    "Terraform wants to destroy and recreate my RDS instance after a provider upgrade. How do I stop it?",
    "GitHub Actions: how do I force a job to run even if a previous job was skipped?",
    "Dockerfile: the build cache is skipped every time after COPY . . — how do I order layers better?",
    "systemd service keeps restarting: Restart=always and StartLimitBurst=5. How do I see why it exits?",
    "Redis eviction policy allkeys-lru or volatile-lru for a session cache with TTLs?",
    "Kafka consumer lag keeps growing on one partition only. Is a bigger instance the fix?",
    "Celery tasks with priority=9 still wait behind low priority ones on RabbitMQ. What am I missing?",
    "How does priority inversion happen with mutexes, and how does priority inheritance fix it?",
    "Implement a skip list in Go with insert, search and delete.",
    "Write a force-directed graph layout in D3 for 500 nodes that does not freeze the page.",
    "Flask debug mode is on in production by mistake. What is the actual risk?",
    "How do I override a method of a parent class in TypeScript and still call the parent?",
    "CSS: my font-family fallback is ignored and Times New Roman shows up instead",
    'Java: Exception in thread "main" java.lang.OutOfMemoryError: Java heap space. -Xmx is already 4g.',
    "undefined reference to `pthread_create' when linking with gcc",
    "error[E0502]: cannot borrow `v` as mutable because it is also borrowed as immutable",
    "My SQL query does a sequential scan although there is an index on created_at. Why?",
    "Write a SQL query that ranks customers into gold, silver and bronze tiers by yearly spend.",
    "How do I upgrade a Kubernetes cluster from 1.28 to 1.30 on EKS with no downtime?",
    "Cloudflare: should I route the API through a separate subdomain to bypass the cache?",
    "Vault token expired in the middle of a deploy. How do I renew it automatically?",
    "Load test shows p99 latency jumps at 800 rps. Scale the instance up to a bigger size or out?",
    "S3 Intelligent-Tiering or lifecycle rules to Glacier for logs older than 90 days?",
    "How do I choose between a small embedding model and a large one for semantic search on 1M documents?",
    "vLLM: what do --max-num-seqs and --gpu-memory-utilization control, and how do I tune them?",
    "The model serving pod gets OOMKilled when two requests with long prompts arrive together.",
    "Prometheus alert: escalate to the SRE channel when error rate > 5% for 10 minutes. Write the rule.",
    "Explain the circuit breaker pattern with retries, timeouts and a fallback response.",
    "Grafana dashboard shows a gap every night at 02:00. Where do I look?",
    "How do I make Webpack skip source maps in production builds?",
    "Our Stripe webhook handler times out. Should we acknowledge first and process in a queue?",
    "Which instance tier do I need for Elasticsearch with 300 GB of logs a day?",
    "What does `--force` do in `terraform apply`? Is it safe?",
    "pip: ResolutionImpossible between tensorflow 2.15 and numpy 2.0. Which one do I pin?",
    "Write a bash one-liner that finds files bigger than 1 GB and sorts them by size.",
)
_TECH_ASKS = ("Quick question. {}", "{} Thanks!", "Hi, {}", "Can you help? {}")

# ... and generated ones: an error from a tool, and a question about it in those same words.
_ERRORS = (
    ("git", "error: failed to push some refs to 'origin'"),
    ("npm", "npm ERR! code ERESOLVE npm ERR! ERESOLVE could not resolve"),
    ("pip", "ERROR: Cannot install -r requirements.txt because these package versions have conflicting dependencies."),
    ("cargo", "error[E0382]: borrow of moved value: `config`"),
    ("gcc", "fatal error: openssl/ssl.h: No such file or directory"),
    ("kubectl", "Error from server (Forbidden): pods is forbidden: User cannot list resource"),
    ("terraform", "Error: Provider produced inconsistent final plan"),
    ("docker build", 'failed to solve: process "/bin/sh -c npm ci" did not complete successfully: exit code: 1'),
    ("Postgres", "FATAL: remaining connection slots are reserved for non-replication superuser connections"),
    ("nginx", "upstream timed out (110: Connection timed out) while reading response header from upstream"),
    ("Python", "ModuleNotFoundError: No module named 'torch'"),
    ("Spring", "java.lang.IllegalStateException: Failed to load ApplicationContext"),
    ("Node", "TypeError: Cannot read properties of undefined (reading 'map')"),
    ("PyTorch", "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    (
        "vLLM",
        "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens that can be "
        "stored in KV cache",
    ),
    ("Xcode", "Command PhaseScriptExecution failed with a nonzero exit code"),
    ("Gradle", "Could not resolve all files for configuration ':app:debugRuntimeClasspath'."),
    ("Excel", "#SPILL! in my XLOOKUP formula"),
    ("PowerShell", "cannot be loaded because running scripts is disabled on this system"),
    ("Unity", "NullReferenceException: Object reference not set to an instance of an object"),
    ("the OpenAI SDK", "openai.RateLimitError: Error code: 429 - You exceeded your current quota"),
    ("Airflow", "Task exited with return code Negsignal.SIGKILL"),
    ("Jenkins", "ERROR: script returned exit code 137"),
    ("MySQL", "ERROR 1213 (40001): Deadlock found when trying to get lock; try restarting transaction"),
    ("Go", "panic: runtime error: invalid memory address or nil pointer dereference"),
    ("AWS Lambda", "Task timed out after 15.02 seconds"),
    ("React Native", 'Invariant Violation: requireNativeComponent: "RNSScreen" was not found in the UIManager'),
    ("Windows Update", "0x800f0922 when installing the cumulative update"),
    ("ssh", "Permission denied (publickey)."),
    ("Hugging Face", "OSError: We couldn't connect to 'https://huggingface.co' to load this file"),
)
_ABOUT_IT = (
    "Is it safe to use --force here?",
    "Should I just skip this step in CI for now?",
    "How do I override this setting for one environment only?",
    "Can I bypass the cache for this one build?",
    "Would raising the job's priority help?",
    "Is the premium tier worth paying for to get rid of this?",
    "Will upgrading to the latest version fix it?",
    "Should I escalate this to the platform team or to the vendor?",
    "How do I route this traffic to the new service instead?",
    "Is my model definition wrong?",
    "Do I need a bigger instance for this?",
    "What is a sensible fallback when this keeps failing?",
    "How do I turn on debug mode to see more?",
    "Do I need admin rights to fix this?",
    "Is there a flaw in my reasoning about the cause?",
    "Which log level should I raise to think this through?",
    "Should I pin the older version or force the newer one?",
    "Can I skip the check with a flag?",
    "Is this a tier limit on my plan?",
    "Would a larger model or more memory change anything?",
)
_ERROR_FORMS = (
    "{tool} fails with:\n\n```\n{error}\n```\n\n{ask}",
    "I keep getting this from {tool}: {error}. {ask}",
    "{error}\n\n{ask}",
    "{ask} ({tool}: `{error}`)",
    "Getting `{error}` in {tool}. {ask}",
    "{tool} error:\n{error}\n{ask}",
)


def developer_prompts(count: int = 480, seed: str = "triage-developer") -> Rows:
    """``count`` generated developers' questions: a tool's error, asked about in the words injections
    use (force, skip, override, premium, escalate, bigger, fallback ...), labeled ``prompt``."""
    out, seen, n = Rows(), set(), 0
    while len(out) < count:  # every text once
        key = f"{seed}:{n}"
        tool, error = _ERRORS[int.from_bytes(hashlib.sha256(f"{key}:e".encode()).digest()[:4], "big") % len(_ERRORS)]
        text = pick(_ERROR_FORMS, key, "form").format(tool=tool, error=error, ask=pick(_ABOUT_IT, key, "ask"))
        if text not in seen:
            seen.add(text)
            out.add(text, CLEAN, f"injection-negative-dev-{n}")
        n += 1
    return out


def hard_negatives(seed: str = "triage-injection-negative") -> Rows:
    """Every topic of ``_ABOUT`` asked three different ways, and every developer prompt of ``_TECH``
    twice, as it is and framed (all labeled ``prompt``)."""
    out = Rows()
    for t, topic in enumerate(_ABOUT):
        asks = sorted(_ASK, key=lambda a: hashlib.sha256(f"{seed}:{t}:{a}".encode()).digest())[:3]
        for k, ask in enumerate(asks):
            out.add(ask.format(topic), CLEAN, f"injection-negative-{t}-{k}")
    for t, text in enumerate(_TECH):
        out.add(text, CLEAN, f"injection-negative-tech-{t}-0")
        out.add(pick(_TECH_ASKS, seed, f"tech{t}").format(text), CLEAN, f"injection-negative-tech-{t}-1")
    dev = developer_prompts()
    for text, id_ in zip(dev.texts, dev.ids, strict=True):
        out.add(text, CLEAN, id_)
    return out
