package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// migrated returns a test database with the key table, and its store.
func migrated(t *testing.T) (*testdb.DB, *idempotency.Store) {
	t.Helper()
	db := testdb.New(t, 2)
	store, err := idempotency.NewStore(db.Pool)
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background()))
	return db, store
}

// A key looked up in the wrong scope: inspect and forget name the scopes
// that hold it, five at most.
func TestInspectNamesTheScopesThatHoldTheKey(t *testing.T) {
	t.Parallel()
	db, store := migrated(t)
	ctx := context.Background()
	charge := func(scope, key string) {
		_, err := store.Execute(ctx, idempotency.Call{Scope: scope, Key: key, Method: "/pay.v1.Pay/Charge"},
			func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil })
		require.NoError(t, err)
	}
	charge("acme", "order-1")
	for _, args := range [][]string{{"inspect", "", "order-1"}, {"forget", "", "order-1"}} {
		_, errOut, code := command(t, nil, "", append([]string{"-database-url", db.URL()}, args...)...)
		require.Equal(t, 1, code)
		require.Equal(t, "idempotency "+args[0]+`: no record of this key in scope ""; the key has records in scope "acme": did you mean it?`+"\n", errOut)
	}
	for _, scope := range []string{"t1", "t2", "t3", "t4", "t5", "t6"} {
		charge(scope, "order-1")
	}
	_, errOut, _ := command(t, nil, "", "-database-url", db.URL(), "inspect", "acme", "order-2")
	require.Equal(t, `idempotency inspect: no record of this key in scope "acme", nor in any other scope`+"\n", errOut)
	_, errOut, _ = command(t, nil, "", "-database-url", db.URL(), "inspect", "t9", "order-1")
	require.Equal(t, `idempotency inspect: no record of this key in scope "t9"; the key has records in scopes "acme", "t1", "t2", "t3", "t4" and more: did you mean one of them?`+"\n", errOut)
}

// listed runs list and returns the scope/key of each record, the page's
// next, and what it examined.
func listed(t *testing.T, url string, args ...string) (keys []string, next string, examined int) {
	t.Helper()
	out, errOut, code := command(t, nil, "", append([]string{"-database-url", url, "list"}, args...)...)
	require.Zero(t, code, errOut)
	var page struct {
		Keys []struct {
			Scope     string `json:"scope"`
			Key       string `json:"key"`
			Transport string `json:"transport"`
		} `json:"keys"`
		Examined int    `json:"examined"`
		Next     string `json:"next"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &page), out)
	keys = []string{}
	for _, k := range page.Keys {
		keys = append(keys, k.Scope+"/"+k.Transport+":"+k.Key)
	}
	if page.Next != "" {
		require.Contains(t, errOut, "run it again with -after "+page.Next)
	}
	return keys, page.Next, page.Examined
}

// list finds keys by scope, method, state and age, in primary-key order,
// a page at a time.
func TestListFilters(t *testing.T) {
	t.Parallel()
	db, _ := migrated(t)
	_, err := db.Pool.Exec(context.Background(), `INSERT INTO idempotency_keys (scope, key, method, fingerprint, state, created_at, expires_at) VALUES
('acme', 'a1', '/pay.v1.Payments/Charge', '\x00', 'succeeded', now() - interval '2 hours', now() + interval '1 day'),
('acme', 'a2', '/pay.v1.Payments/Refund', '\x00', 'failed', now() - interval '10 minutes', now() + interval '1 day'),
('acme', 'http a3', 'POST /v1/charges', '\x00', 'succeeded', now() - interval '1 minute', now() + interval '1 day'),
('beta', 'b1', '/pay.v1.Payments/Charge', '\x00', 'failed', now() - interval '3 hours', now() - interval '1 hour'),
('', 'message e1', 'idempotency/message', '\x00', 'succeeded', now() - interval '5 minutes', now() + interval '1 day')`)
	require.NoError(t, err)
	url := db.URL()
	all := []string{"/message:e1", "acme/grpc:a1", "acme/grpc:a2", "acme/http:a3", "beta/grpc:b1"}
	for _, c := range []struct {
		args []string
		want []string
	}{
		{nil, all},
		{[]string{"-scope", "acme"}, []string{"acme/grpc:a1", "acme/grpc:a2", "acme/http:a3"}},
		{[]string{"-scope", ""}, []string{"/message:e1"}},
		{[]string{"-state", "failed"}, []string{"acme/grpc:a2", "beta/grpc:b1"}},
		{[]string{"-method", "/pay.v1.Payments/*"}, []string{"acme/grpc:a1", "acme/grpc:a2", "beta/grpc:b1"}},
		{[]string{"-method", "POST /v1/charges"}, []string{"acme/http:a3"}},
		{[]string{"-newer-than", "30m"}, []string{"/message:e1", "acme/grpc:a2", "acme/http:a3"}},
		{[]string{"-older-than", "1h"}, []string{"acme/grpc:a1", "beta/grpc:b1"}},
		{[]string{"-scope", "acme", "-state", "failed", "-newer-than", "1h"}, []string{"acme/grpc:a2"}},
		{[]string{"-scope", "gamma"}, []string{}},
	} {
		keys, next, _ := listed(t, url, c.args...)
		require.Equal(t, c.want, keys, c.args)
		require.Empty(t, next, c.args)
	}

	// Pages: -limit, then -after the page's next, to the end.
	var paged []string
	next := ""
	for pages := 0; ; pages++ {
		require.Less(t, pages, 3)
		keys, n, _ := listed(t, url, "-limit", "2", "-after", next)
		paged = append(paged, keys...)
		if next = n; next == "" {
			break
		}
	}
	require.Equal(t, all, paged)

	// -examine bounds the rows read: two rows, neither failed, then the
	// two after them.
	keys, next, examined := listed(t, url, "-state", "failed", "-examine", "2")
	require.Equal(t, []string{}, keys)
	require.Equal(t, 2, examined)
	require.NotEmpty(t, next)
	keys, _, examined = listed(t, url, "-state", "failed", "-examine", "2", "-after", next)
	require.Equal(t, []string{"acme/grpc:a2"}, keys)
	require.Equal(t, 2, examined)

	_, errOut, code := command(t, nil, "", "-database-url", url, "list", "-state", "done")
	require.Equal(t, 1, code)
	require.Contains(t, errOut, `"done" is not a state; use succeeded, failed or running`)
	_, errOut, code = command(t, nil, "", "-database-url", url, "list", "-scope", "beta", "-after", next)
	require.Equal(t, 1, code)
	require.Contains(t, errOut, `the page it continues listed scope "acme", not "beta"`)
}

// descriptorSet writes a FileDescriptorSet of the test protos and their
// imports, as protoc --include_imports would, and returns its path.
func descriptorSet(t *testing.T) string {
	t.Helper()
	set := &descriptorpb.FileDescriptorSet{}
	seen := map[string]bool{}
	var add func(fd protoreflect.FileDescriptor)
	add = func(fd protoreflect.FileDescriptor) {
		if seen[fd.Path()] {
			return
		}
		seen[fd.Path()] = true
		for i := 0; i < fd.Imports().Len(); i++ {
			add(fd.Imports().Get(i).FileDescriptor)
		}
		set.File = append(set.File, protodesc.ToFileDescriptorProto(fd))
	}
	add(testingv1.File_idempotency_testing_v1_policy_proto)
	b, err := proto.Marshal(set)
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "image.binpb")
	require.NoError(t, os.WriteFile(path, b, 0o600))
	return path
}

// A response of the user's own type, and an error with a detail of one:
// without their descriptors, hex and a hint that says how; with them
// (-proto-descriptors), JSON.
func TestInspectDecodesTheUsersTypesFromADescriptorSet(t *testing.T) {
	t.Parallel()
	db, store := migrated(t)
	ctx := context.Background()
	_, err := store.Execute(ctx, idempotency.Call{Scope: "acme", Key: "ok", Method: "/idempotency.testing.v1.PolicyService/Required"},
		func(context.Context, pgx.Tx) (proto.Message, error) {
			return &testingv1.Response{Body: "charged", LedgerId: 7}, nil
		})
	require.NoError(t, err)
	st, err := status.New(codes.FailedPrecondition, "card declined").WithDetails(&testingv1.Meta{RequestId: "req-9"})
	require.NoError(t, err)
	_, err = store.Execute(ctx, idempotency.Call{Scope: "acme", Key: "declined", Method: "/idempotency.testing.v1.PolicyService/Required"},
		func(context.Context, pgx.Tx) (proto.Message, error) { return nil, idempotency.Final(st.Err()) })
	require.True(t, idempotency.IsFinal(err))

	type out struct {
		Response    json.RawMessage `json:"response"`
		ResponseHex string          `json:"response_hex"`
		Hint        string          `json:"hint"`
		Status      struct {
			Message string           `json:"message"`
			Details []map[string]any `json:"details"`
		} `json:"status"`
	}
	inspect := func(key string, flags ...string) out {
		stdout, errOut, code := command(t, nil, "", append(append([]string{"-database-url", db.URL()}, flags...), "inspect", "acme", key)...)
		require.Zero(t, code, errOut)
		var o out
		require.NoError(t, json.Unmarshal([]byte(stdout), &o), stdout)
		return o
	}
	without := inspect("ok")
	require.Empty(t, without.Response)
	require.NotEmpty(t, without.ResponseHex)
	require.Contains(t, without.Hint, "does not know the message type idempotency.testing.v1.Response: give it -proto-descriptors FILE")
	declined := inspect("declined")
	require.Equal(t, "card declined", declined.Status.Message, "the status is shown though its detail's type is unknown")
	require.Len(t, declined.Status.Details, 1)
	require.Equal(t, "type.googleapis.com/idempotency.testing.v1.Meta", declined.Status.Details[0]["@type"])
	require.Contains(t, declined.Status.Details[0]["hint"], "-proto-descriptors")

	set := descriptorSet(t)
	with := inspect("ok", "-proto-descriptors", set)
	require.JSONEq(t, `{"body":"charged","ledgerId":"7"}`, string(with.Response))
	require.Empty(t, with.ResponseHex)
	require.Empty(t, with.Hint)
	declined = inspect("declined", "-proto-descriptors", set)
	require.Equal(t, []map[string]any{{"@type": "type.googleapis.com/idempotency.testing.v1.Meta", "requestId": "req-9"}}, declined.Status.Details)

	// list decodes them too.
	stdout, errOut, code := command(t, nil, "", "-database-url", db.URL(), "-proto-descriptors", set, "list", "-scope", "acme", "-state", "succeeded")
	require.Zero(t, code, errOut)
	require.Contains(t, stdout, `"ledgerId": "7"`)

	// A file that is no descriptor set says how to make one.
	bad := filepath.Join(t.TempDir(), "bad.binpb")
	require.NoError(t, os.WriteFile(bad, []byte("not a descriptor set"), 0o600))
	_, errOut, code = command(t, nil, "", "-database-url", db.URL(), "-proto-descriptors", bad, "inspect", "acme", "ok")
	require.Equal(t, 2, code)
	require.Contains(t, errOut, "is not a binary FileDescriptorSet or buf image (make one with buf build -o FILE, or protoc --include_imports --descriptor_set_out=FILE)")
}

// A record the first HTTP middleware stored with the response's
// Set-Cookie: inspect shows the headers a replay sends, without it.
func TestInspectShowsNoSetCookie(t *testing.T) {
	t.Parallel()
	db, store := migrated(t)
	h := idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":"ch_1"}`)
	}))
	req := httptest.NewRequest(http.MethodPost, "/v1/charges", strings.NewReader(`{"amount":100}`))
	req.Header.Set(idempotency.HeaderKey, "order-1")
	h.ServeHTTP(httptest.NewRecorder(), req)
	entry := func(name, value string) []byte {
		e := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), name)
		e = protowire.AppendString(protowire.AppendTag(e, 2, protowire.BytesType), value)
		return protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), e)
	}
	metadata := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), http.StatusCreated)
	metadata = append(metadata, entry("Content-Type", "application/json")...)
	metadata = append(metadata, entry("Set-Cookie", "session=first-caller; HttpOnly")...)
	_, err := db.Pool.Exec(context.Background(), `UPDATE idempotency_keys SET metadata = $1 WHERE key = 'http order-1'`, metadata)
	require.NoError(t, err)

	out, errOut, code := command(t, nil, "", "-database-url", db.URL(), "inspect", "", "order-1")
	require.Zero(t, code, errOut)
	require.Contains(t, out, `"Content-Type": [`)
	require.NotContains(t, strings.ToLower(out), "set-cookie")
	require.NotContains(t, out, "first-caller")
}

// cleanup deletes in batches paced as the library's cleaner paces them:
// 25 expired keys in batches of 10 are three batches, a pause after each
// of the two full ones, none after the last.
func TestCleanupPacesItsBatches(t *testing.T) {
	t.Parallel()
	db, _ := migrated(t)
	_, err := db.Pool.Exec(context.Background(), `INSERT INTO idempotency_keys (scope, key, method, fingerprint, state, created_at, expires_at)
SELECT 's', 'expired-' || i, 'm', '\x00', 'succeeded', now() - interval '2 hours', now() - interval '1 hour' FROM generate_series(1, 25) i`)
	require.NoError(t, err)
	out, errOut, code := command(t, nil, "", "-database-url", db.URL(), "cleanup", "-batch", "10")
	require.Zero(t, code, errOut)
	require.Equal(t, "deleted 25 expired keys\n", out)
	lines := strings.Split(strings.TrimSpace(errOut), "\n")
	require.Len(t, lines, 3, errOut)
	pausing := regexp.MustCompile(`; pausing [0-9.]+[µm]?s \(nine times the batch, as the cleaner does\)$`)
	for i, want := range []string{"batch 1: deleted 10 expired keys in ", "batch 2: deleted 10 expired keys in ", "batch 3: deleted 5 expired keys in "} {
		require.True(t, strings.HasPrefix(lines[i], want), lines[i])
		require.Equal(t, i < 2, pausing.MatchString(lines[i]), lines[i])
	}
	require.Zero(t, db.Count(t, `SELECT count(*) FROM idempotency_keys`))

	_, _, code = command(t, nil, "", "-database-url", db.URL(), "cleanup", "-batch", "0")
	require.Equal(t, 2, code)
}
