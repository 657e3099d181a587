package payments_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/examples/payments"
	paymentsv1 "github.com/exactlyonce/idempotency/examples/payments/proto/payments/v1"
	"github.com/exactlyonce/idempotency/examples/payments/provider"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// The HTTP face of the service: the names tools outside the project call,
// on the same business code and store as gRPC.
func TestHTTPChargesAndBalance(t *testing.T) {
	t.Parallel()
	db, store, srv := newHTTPService(t)
	ctx := context.Background()
	do := func(method, path, key, body string) (int, http.Header, string) {
		req, err := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		require.NoError(t, err)
		if key != "" {
			req.Header.Set(idempotency.HeaderKey, key)
		}
		req.Header.Set("Authorization", "Bearer demo-token-alice")
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, resp.Header, string(b)
	}

	code, h, first := do(http.MethodPost, "/v1/charges", "order-1001", `{"account_id": "acct-1", "amount_cents": 100}`)
	require.Equal(t, http.StatusOK, code, first)
	require.Equal(t, "application/json", h.Get("Content-Type"))
	var charge map[string]any
	require.NoError(t, json.Unmarshal([]byte(first), &charge))
	require.Equal(t, "acct-1", charge["account_id"])
	require.Equal(t, "100", charge["amount_cents"], "int64 fields are JSON strings, as protojson writes them")
	require.Equal(t, "100", charge["balance_cents"])
	require.True(t, strings.HasPrefix(charge["charge_id"].(string), "ch_"))
	require.Len(t, charge, 4, "exactly the ChargeResponse fields, by their proto names")

	code, h, again := do(http.MethodPost, "/v1/charges", "order-1001", `{"account_id": "acct-1", "amount_cents": 100}`)
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, first, again, "the replay, byte for byte")
	require.Equal(t, "true", h.Get(idempotency.ReplayedHeader))

	code, _, body := do(http.MethodPost, "/v1/charges", "order-1001", `{"account_id": "acct-1", "amount_cents": 900}`)
	require.Equal(t, http.StatusUnprocessableEntity, code, body)
	code, _, body = do(http.MethodPost, "/v1/charges", "", `{"account_id": "acct-1", "amount_cents": 5}`)
	require.Equal(t, http.StatusBadRequest, code, body)
	code, _, body = do(http.MethodPost, "/v1/charges", "bad-json", `{"account_id": `)
	require.Equal(t, http.StatusBadRequest, code, body)
	code, _, body = do(http.MethodPost, "/v1/charges", "bad-json", `{"account_id": "acct-1", "amount_cents": 5}`)
	require.Equal(t, http.StatusOK, code, "a 400 is not stored: the corrected request reuses the key: %s", body)

	code, h, body = do(http.MethodGet, "/v1/accounts/acct-1/balance", "", "")
	require.Equal(t, http.StatusOK, code, body)
	require.Empty(t, h.Get(idempotency.ReplayedHeader))
	var bal map[string]any
	require.NoError(t, json.Unmarshal([]byte(body), &bal))
	require.Equal(t, map[string]any{"account_id": "acct-1", "balance_cents": "105", "charges": "2", "declined_charges": "0"}, bal)

	// gRPC sees the same accounts.
	c, _ := newServiceOn(t, db, store)
	grpcBal, err := c.GetBalance(ctx, &paymentsv1.GetBalanceRequest{AccountId: "acct-1"})
	require.NoError(t, err)
	require.EqualValues(t, 105, grpcBal.GetBalanceCents())
}

// It failed when the example mounted the middleware with the default
// scope, shared by every caller: bob, sending alice's key and body, got
// alice's stored charge. Each caller's keys are their own.
func TestHTTPCallersKeysAreTheirOwn(t *testing.T) {
	t.Parallel()
	db, _, srv := newHTTPService(t)
	charge := func(token string) (int, string) {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/charges", strings.NewReader(`{"account_id": "acct-shared", "amount_cents": 100}`))
		require.NoError(t, err)
		req.Header.Set(idempotency.HeaderKey, "order-1")
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		require.Empty(t, resp.Header.Get(idempotency.ReplayedHeader), "no caller gets another's stored response")
		return resp.StatusCode, string(b)
	}
	code, alice := charge("demo-token-alice")
	require.Equal(t, http.StatusOK, code, alice)
	code, bob := charge("demo-token-bob")
	require.Equal(t, http.StatusOK, code, bob)
	require.NotEqual(t, alice, bob, "bob's charge is his own")
	code, body := charge("")
	require.Equal(t, http.StatusUnauthorized, code, body)
	code, body = charge("stolen-token")
	require.Equal(t, http.StatusUnauthorized, code, body)
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/charges", strings.NewReader(`{"account_id": "acct-shared", "amount_cents": 100}`))
	require.NoError(t, err)
	req.Header.Set(idempotency.HeaderKey, "order-1")
	req.Header.Set("Authorization", "bearer demo-token-bob")
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "the scheme is case-insensitive")
	require.Equal(t, "true", resp.Header.Get(idempotency.ReplayedHeader), "bob's own charge, replayed")
	require.Equal(t, 2, db.Count(t, `SELECT count(*) FROM ledger WHERE account_id = 'acct-shared'`))
}

// It failed when the keys a call derives hashed the bytes of its JSON
// body: the charge's run died after the provider answered (its handler
// aborted: nothing committed, the key free), and the client's retry, the
// same JSON with its members in another order, which the middleware calls
// the same request, charged the provider under another key: 2 provider
// charges, 1 ledger row. (Its step's key is derived the same way: another
// key would find no record of the first run's step.)
func TestHTTPRetryWrittenAnotherWayAfterTheProviderAnsweredChargesOnce(t *testing.T) {
	// Not parallel: with its provider it needs 14 of the server's
	// connections, as the provider's tests do.
	w := newWorld(t, 0)
	var answers atomic.Int64
	svc := payments.NewServer(w.db.Pool, payments.WithProvider(&provider.Client{BaseURL: w.providerURL, Merchant: "test"}),
		payments.WithAfterProvider(func(context.Context) {
			if answers.Add(1) == 1 {
				panic(http.ErrAbortHandler) // the run dies with the provider's answer
			}
		}))
	srv := httptest.NewServer(payments.NewHTTPHandler(svc, w.store, payments.DemoCallers()))
	t.Cleanup(srv.Close)
	charge := func(body string) (*http.Response, error) {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/charges", strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set(idempotency.HeaderKey, "order-77")
		req.Header.Set("Authorization", "Bearer demo-token-alice")
		req.Header.Set("Content-Type", "application/json")
		return srv.Client().Do(req)
	}

	_, err := charge(`{"account_id":"acct-1","amount_cents":250}`)
	require.Error(t, err, "the first run died before it answered")
	require.Equal(t, counts{providerCharges: 1}, w.counts(t), "the provider charged; the dead run committed nothing")
	resp, err := charge(`{"amount_cents":250,"account_id":"acct-1"}`)
	require.NoError(t, err)
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
	require.Equal(t, counts{providerCharges: 1, ledgerRows: 1, settled: 1}, w.counts(t), "the retry got the first charge back")
	require.EqualValues(t, 1, w.provider.executed.Load())
	require.Zero(t, w.provider.replayed.Load(), "the retry's step, under the first run's key, had the provider's answer recorded: the provider was not asked")
}

// newHTTPService serves the HTTP API with the demo callers on a database
// of its own.
func newHTTPService(t *testing.T) (*testdb.DB, *idempotency.Store, *httptest.Server) {
	t.Helper()
	db := testdb.New(t, 8)
	store, err := idempotency.NewStore(db.Pool)
	require.NoError(t, err)
	require.NoError(t, payments.Migrate(context.Background(), db.Pool, store))
	srv := httptest.NewServer(payments.NewHTTPHandler(payments.NewServer(db.Pool), store, payments.DemoCallers()))
	t.Cleanup(srv.Close)
	return db, store, srv
}
