package natsconsumer_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency/examples/natsconsumer"
)

// A consumer process starts again: its JetStream consumer is made again the
// way the program makes it, after the old one was deleted (as the server
// deletes an ephemeral after its InactiveThreshold), and JetStream delivers
// the whole stream again. Each ID must be applied once across the restart,
// so the scope must come back with the program, not with the consumer: a
// durable's name does; a consumer without one needs WithScope, since its
// name may be generated afresh on each creation (nats.go names an unnamed
// consumer itself, and the server cannot tell that name from one the
// program chose). Before, New took an ephemeral with the default scope
// "<stream>/<its name>", and every message of an unnamed one was applied
// again after the restart: two credit rows per ID. A scope the store
// refuses is refused by New too; before, every message was nacked forever.
func TestEachIDAppliedOnceAcrossConsumerRestart(t *testing.T) {
	t.Parallel()
	explicit := jetstream.ConsumerConfig{AckPolicy: jetstream.AckExplicitPolicy, AckWait: 5 * time.Second}
	withName := func(name, durable string) jetstream.ConsumerConfig {
		c := explicit
		c.Name, c.Durable = name, durable
		return c
	}
	for _, tc := range []struct {
		name    string
		config  jetstream.ConsumerConfig
		ordered bool
		scope   string
		// refused is what New's error says, or empty when New accepts the
		// consumer.
		refused string
	}{
		{name: "durable", config: withName("", randomName("durable_"))},
		{name: "durable with a scope", config: withName("", randomName("durable_")), scope: "credits"},
		{name: "unnamed ephemeral", config: explicit, refused: "natsconsumer.WithScope"},
		{name: "unnamed ephemeral with a scope", config: explicit, scope: "credits"},
		{name: "named ephemeral", config: withName(randomName("named_"), ""), refused: "natsconsumer.WithScope"},
		{name: "named ephemeral with a scope", config: withName(randomName("named_"), ""), scope: "credits"},
		{name: "durable with a scope the store refuses", config: withName("", randomName("durable_")), scope: "credits\xff", refused: "WithScope"},
		{name: "ordered", ordered: true, refused: "want explicit"},
		{name: "ordered with a scope", ordered: true, scope: "credits", refused: "want explicit"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool, store := newDB(t)
			_, js := connect(t)
			stream, _, subject := newStream(t, js, 0, 5*time.Second)
			ctx := context.Background()

			want := map[string]natsconsumer.Credit{}
			var last uint64
			for i := range 4 {
				id, c := fmt.Sprintf("credit-%d", i), natsconsumer.Credit{Account: fmt.Sprintf("acct-%d", i%2), AmountCents: int64(100 + i)}
				want[id] = c
				last = publish(t, js, subject, id, c).Sequence
			}
			var opts []natsconsumer.Option
			if tc.scope != "" {
				opts = append(opts, natsconsumer.WithScope(tc.scope))
			}

			var runs [2]tally
			for run := range runs {
				var cons jetstream.Consumer
				var err error
				if tc.ordered {
					cons, err = js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
				} else {
					cons, err = js.CreateOrUpdateConsumer(ctx, stream, tc.config)
				}
				require.NoError(t, err)
				name := cons.CachedInfo().Name
				c, err := natsconsumer.New(store, cons, natsconsumer.ApplyCredit, append(opts, runs[run].hook())...)
				if err != nil {
					require.NotEmpty(t, tc.refused, "New refused consumer %s: %v", name, err)
					require.ErrorContains(t, err, tc.refused)
					t.Logf("refused: %v", err)
					return
				}
				t.Logf("run %d: consumer %s", run+1, name)
				stop := start(t, ctx, c)
				waitConsumerAcked(t, cons, last, func() bool { return len(runs[run].all()) >= len(want) })
				require.ErrorIs(t, stop(), context.Canceled)
				require.NoError(t, js.DeleteConsumer(ctx, stream, name))
			}
			t.Logf("first run: %v; second run: %v", &runs[0], &runs[1])
			requireAppliedOnce(t, pool, want)
			require.Equal(t, len(want), runs[0].count(natsconsumer.Applied), "applied by the first run")
			require.Equal(t, len(want), runs[1].count(natsconsumer.Duplicate), "found applied by the second run")
			require.Empty(t, tc.refused, "New accepted the consumer, which it should have refused")
		})
	}
}
