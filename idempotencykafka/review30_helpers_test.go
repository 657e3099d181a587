package idempotencykafka_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// custom is a consumer of the group with a handler and client options of
// the test's own, running until the test ends or stop is called.
type custom struct {
	client   *kgo.Client
	consumer *idempotencykafka.Consumer
	stop     func()
}

func (w *world) startCustom(t *testing.T, store *idempotency.Store, group, topic string, handle idempotencykafka.Handler, clientOpts []kgo.Opt, opts ...idempotencykafka.Option) *custom {
	t.Helper()
	client, err := kgo.NewClient(consumerOpts(w.brokers, group, topic, clientOpts...)...)
	require.NoError(t, err)
	return runCustom(t, store, client, handle, opts...)
}

// runCustom runs a consumer on a client the test built.
func runCustom(t *testing.T, store *idempotency.Store, client *kgo.Client, handle idempotencykafka.Handler, opts ...idempotencykafka.Option) *custom {
	t.Helper()
	c, err := idempotencykafka.New(store, client, handle, opts...)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	m := &custom{client: client, consumer: c}
	m.stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("Run: %v", err)
			}
			client.Close()
		})
	}
	t.Cleanup(m.stop)
	return m
}
